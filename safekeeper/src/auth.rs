//! JWT authentication, as neon does it: EdDSA (Ed25519) tokens checked against the public keys
//! of `--auth-public-key-path` (a PEM file, or a directory of them), reloaded on SIGHUP.
//!
//! A token's claims carry a `scope`: `safekeeperdata` grants everything, `tenant` only the
//! timelines of its `tenant_id`; any other scope (a pageserver's, an admin's) grants nothing
//! here. `exp`, when present, is checked. The PostgreSQL port takes the token as the password,
//! HTTP as `Authorization: Bearer <token>`.
//!
//! Not here: where the checks are applied (the HTTP route classes in [`crate::http`], the
//! handshake and each command's timeline in [`crate::wal_service`] and
//! [`crate::receive_wal`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, RwLock};

use anyhow::{Context, bail};
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use serde::Deserialize;

use crate::secrets::read_secret_file;
use sk_core::types::TenantId;

/// What a token may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Scope {
    /// Only the timelines of the claims' `tenant_id`.
    Tenant,
    /// Every timeline and route of the safekeeper.
    #[serde(rename = "safekeeperdata")]
    SafekeeperData,
    /// A scope for another service (neon's `pageserverapi`, `admin`, ...): grants nothing here.
    #[serde(other)]
    Other,
}

/// A verified token's claims.
#[derive(Debug, Clone, Deserialize)]
pub struct Claims {
    /// The tenant of a `tenant` token.
    #[serde(default)]
    pub tenant_id: Option<String>,
    /// What the token may do.
    pub scope: Scope,
}

/// Why a request is refused: HTTP 401 / 403; on the PostgreSQL port both are SQLSTATE 28000.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// No token, or one that is not valid (malformed, expired, signed by no key we have).
    #[error("{0}")]
    Unauthenticated(String),
    /// A valid token that does not grant this.
    #[error("{0}")]
    Forbidden(String),
}

/// The public keys tokens are checked against, reloadable.
pub struct JwtAuth {
    path: PathBuf,
    keys: RwLock<Arc<Vec<DecodingKey>>>,
    validation: Validation,
}

impl std::fmt::Debug for JwtAuth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JwtAuth").field("path", &self.path).finish()
    }
}

impl JwtAuth {
    /// Loads the keys of `path`: a PEM file with one Ed25519 public key, or a directory whose
    /// every file is one. An unreadable or empty file, a file that is not an Ed25519 public
    /// key, or a directory without keys is an error naming it.
    pub fn load(path: &Path) -> anyhow::Result<JwtAuth> {
        let mut validation = Validation::new(Algorithm::EdDSA);
        // As neon: `exp` is checked when present, not required; no audience or issuer.
        validation.required_spec_claims.clear();
        validation.validate_aud = false;
        validation.leeway = 0;
        Ok(JwtAuth {
            path: path.to_path_buf(),
            keys: RwLock::new(Arc::new(load_keys(path)?)),
            validation,
        })
    }

    /// Reads the keys again (SIGHUP). On error the old keys stay in force. Returns how many
    /// keys are now loaded.
    pub fn reload(&self) -> anyhow::Result<usize> {
        let keys = load_keys(&self.path)?;
        let n = keys.len();
        *self.keys.write().expect("key lock poisoned") = Arc::new(keys);
        Ok(n)
    }

    /// Where the keys come from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Verifies `token` against every key and returns its claims.
    pub fn decode(&self, token: &str) -> Result<Claims, AuthError> {
        let keys = self.keys.read().expect("key lock poisoned").clone();
        let mut last = ErrorKind::InvalidSignature;
        for key in keys.iter() {
            match jsonwebtoken::decode::<Claims>(token, key, &self.validation) {
                Ok(data) => return Ok(data.claims),
                // Another key may have signed it.
                Err(e) if matches!(e.kind(), ErrorKind::InvalidSignature) => {}
                Err(e) => {
                    last = e.into_kind();
                    break;
                }
            }
        }
        Err(AuthError::Unauthenticated(match last {
            ErrorKind::InvalidSignature => "invalid token: signed by none of our keys".into(),
            ErrorKind::ExpiredSignature => "invalid token: expired".into(),
            ErrorKind::ImmatureSignature => "invalid token: not valid yet (nbf)".into(),
            ErrorKind::InvalidAlgorithm => "invalid token: the algorithm must be EdDSA".into(),
            other => format!("invalid token: {other:?}"),
        }))
    }
}

/// Whether `claims` grant access to `tenant`'s timelines, or (`None`) to the whole safekeeper.
pub fn check_permission(claims: &Claims, tenant: Option<TenantId>) -> Result<(), AuthError> {
    match claims.scope {
        Scope::SafekeeperData => Ok(()),
        Scope::Tenant => {
            let Some(granted) = claims.tenant_id.as_deref() else {
                return Err(AuthError::Unauthenticated(
                    "invalid token: scope tenant without a tenant_id".into(),
                ));
            };
            match tenant {
                Some(t) if granted.eq_ignore_ascii_case(&t.to_string()) => Ok(()),
                Some(t) => Err(AuthError::Forbidden(format!(
                    "the token is for tenant {granted}, not {t}"
                ))),
                None => Err(AuthError::Forbidden(
                    "a tenant token grants only its tenant's timelines; this needs scope \
                     safekeeperdata"
                        .into(),
                )),
            }
        }
        Scope::Other => Err(AuthError::Forbidden(
            "the token's scope grants nothing on a safekeeper: use safekeeperdata or tenant".into(),
        )),
    }
}

/// Loads one key file, or every file of a directory.
fn load_keys(path: &Path) -> anyhow::Result<Vec<DecodingKey>> {
    let flag = "--auth-public-key-path";
    let meta = std::fs::metadata(path)
        .with_context(|| format!("{flag} {}: cannot read", path.display()))?;
    if !meta.is_dir() {
        return Ok(vec![load_key(path)?]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(path)
        .with_context(|| format!("{flag} {}: cannot read the directory", path.display()))?
    {
        let entry = entry.with_context(|| format!("{flag} {}", path.display()))?;
        if entry.file_type().map(|t| !t.is_dir()).unwrap_or(true) {
            files.push(entry.path());
        }
    }
    files.sort();
    if files.is_empty() {
        bail!(
            "{flag} {}: the directory holds no key files",
            path.display()
        );
    }
    files.iter().map(|f| load_key(f)).collect()
}

fn load_key(path: &Path) -> anyhow::Result<DecodingKey> {
    let pem = read_secret_file("--auth-public-key-path", path)?;
    DecodingKey::from_ed_pem(&pem).with_context(|| {
        format!(
            "--auth-public-key-path {}: not an Ed25519 public key in PEM",
            path.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn claims(scope: Scope, tenant: Option<&str>) -> Claims {
        Claims {
            tenant_id: tenant.map(str::to_string),
            scope,
        }
    }

    #[test]
    fn scopes_grant_what_neon_grants() {
        let t: TenantId = "de200bd42b49cc1814412c7e592dd6e9".parse().unwrap();
        let other: TenantId = "00000000000000000000000000000001".parse().unwrap();
        let data = claims(Scope::SafekeeperData, None);
        assert_eq!(check_permission(&data, Some(t)), Ok(()));
        assert_eq!(check_permission(&data, None), Ok(()));
        let tenant = claims(Scope::Tenant, Some("de200bd42b49cc1814412c7e592dd6e9"));
        assert_eq!(check_permission(&tenant, Some(t)), Ok(()));
        assert!(matches!(
            check_permission(&tenant, Some(other)),
            Err(AuthError::Forbidden(_))
        ));
        assert!(matches!(
            check_permission(&tenant, None),
            Err(AuthError::Forbidden(_))
        ));
        let no_tenant = claims(Scope::Tenant, None);
        assert!(matches!(
            check_permission(&no_tenant, Some(t)),
            Err(AuthError::Unauthenticated(_))
        ));
        let admin = claims(Scope::Other, None);
        assert!(matches!(
            check_permission(&admin, Some(t)),
            Err(AuthError::Forbidden(_))
        ));
    }

    #[test]
    fn unknown_scopes_decode_as_other() {
        let c: Claims = serde_json::from_str(r#"{"scope":"pageserverapi"}"#).unwrap();
        assert_eq!(c.scope, Scope::Other);
        let c: Claims = serde_json::from_str(r#"{"scope":"safekeeperdata"}"#).unwrap();
        assert_eq!(c.scope, Scope::SafekeeperData);
        let c: Claims = serde_json::from_str(r#"{"scope":"tenant","tenant_id":"ab"}"#).unwrap();
        assert_eq!(
            (c.scope, c.tenant_id.as_deref()),
            (Scope::Tenant, Some("ab"))
        );
    }

    #[test]
    fn key_paths_that_hold_no_key_are_refused_naming_them() {
        let dir = tempfile::tempdir().unwrap();
        let err = format!("{:#}", JwtAuth::load(dir.path()).err().unwrap());
        assert!(err.contains("holds no key files"), "{err}");
        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let err = format!("{:#}", JwtAuth::load(dir.path()).err().unwrap());
        assert!(err.contains("empty.pem") && err.contains("empty"), "{err}");
        std::fs::write(&empty, "not a key\n").unwrap();
        let err = format!("{:#}", JwtAuth::load(&empty).err().unwrap());
        assert!(
            err.contains("empty.pem") && err.contains("Ed25519"),
            "{err}"
        );
        let err = format!(
            "{:#}",
            JwtAuth::load(&dir.path().join("missing")).err().unwrap()
        );
        assert!(err.contains("missing"), "{err}");
    }
}
