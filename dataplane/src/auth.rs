//! Who may use the data plane (ARCHITECTURE.md §10): the per-deployment secret, the
//! HMAC-SHA256 challenge-response every producer and side-channel connection opens with, and
//! the per-request transfer capability.
//!
//! The secret never crosses the wire: a server sends a fresh nonce, the client answers with
//! its own nonce and `HMAC(secret, channel | "client" | server nonce | client nonce)`, and the
//! server proves itself back with the same over `"server"`. A replayed answer fails, because
//! the server's nonce is new for every connection. Without a secret (a worker that binds
//! loopback only and was given none) the key is empty: the exchange still runs, so both sides
//! speak one protocol, but it proves nothing and the capability alone guards a request.

use crate::hex::{from_hex, to_hex};
use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The environment variable a worker reads its secret from.
pub const SECRET_ENV: &str = "KVCONNECT_SIDE_CHANNEL_TOKEN";

/// Key of `kv_connector_extra_config` under which the host hands the secret to a connector
/// whose data plane needs it (in memory; a user-written config must not carry it).
pub const SECRET_CONFIG_KEY: &str = "data_plane_secret";

/// The fewest bytes a secret may have.
pub const MIN_SECRET_BYTES: usize = 16;

/// Bytes of a nonce and of a transfer capability (128 bits).
pub const NONCE_BYTES: usize = 16;

/// Why a secret, a nonce or a capability could not be had.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    /// The secret is too short to resist guessing.
    #[error(
        "the data-plane secret from {source_name} has {len} bytes; use at least {MIN_SECRET_BYTES} \
        random bytes (e.g. `openssl rand -hex 32`)"
    )]
    ShortSecret {
        /// Where it came from.
        source_name: String,
        /// Its length.
        len: usize,
    },
    /// The operating system's random number generator failed.
    #[error("the operating system's random number generator failed: {0}")]
    Rng(String),
}

/// A per-deployment secret. Its `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secret(<{} bytes>)", self.0.len())
    }
}

impl Secret {
    /// A secret from text (surrounding whitespace removed, as read from a file or the
    /// environment); `source_name` says where it came from, for the error.
    pub fn from_text(text: &str, source_name: &str) -> Result<Secret, AuthError> {
        let t = text.trim();
        if t.len() < MIN_SECRET_BYTES {
            return Err(AuthError::ShortSecret { source_name: source_name.to_owned(), len: t.len() });
        }
        Ok(Secret(t.as_bytes().to_vec()))
    }

    /// A fresh random secret (what `kvconnect up` hands its workers).
    pub fn generate() -> Result<Secret, AuthError> {
        Ok(Secret(to_hex(&random_bytes::<32>()?).into_bytes()))
    }

    /// The secret as text, to hand to a child process by environment or file.
    pub fn to_text(&self) -> String {
        String::from_utf8_lossy(&self.0).into_owned()
    }

    fn key(s: Option<&Secret>) -> &[u8] {
        s.map(|s| s.0.as_slice()).unwrap_or(&[])
    }
}

/// `N` bytes from the operating system's random number generator.
pub fn random_bytes<const N: usize>() -> Result<[u8; N], AuthError> {
    let mut b = [0u8; N];
    getrandom::fill(&mut b).map_err(|e| AuthError::Rng(e.to_string()))?;
    Ok(b)
}

/// `N` bytes from the operating system's random number generator, hex-encoded (`2 * N`
/// digits): nonces, capabilities, names that cannot be guessed.
pub fn random_hex<const N: usize>() -> Result<String, AuthError> {
    Ok(to_hex(&random_bytes::<N>()?))
}

/// A fresh nonce, hex-encoded.
pub fn nonce() -> Result<String, AuthError> {
    random_hex::<NONCE_BYTES>()
}

/// Which side of an exchange a proof is from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// The connecting side.
    Client,
    /// The listening side.
    Server,
}

fn mac(
    secret: Option<&Secret>,
    channel: &str,
    side: Side,
    server_nonce: &str,
    client_nonce: &str,
) -> Hmac<Sha256> {
    // HMAC takes keys of any length, the empty one included.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(Secret::key(secret))
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
    let side = match side {
        Side::Client => "client",
        Side::Server => "server",
    };
    for part in [channel, side, server_nonce, client_nonce] {
        m.update(&(part.len() as u64).to_be_bytes());
        m.update(part.as_bytes());
    }
    m
}

/// The proof `side` sends on `channel` (`"producer"`, `"side-channel"`) for these nonces.
pub fn proof(
    secret: Option<&Secret>,
    channel: &str,
    side: Side,
    server_nonce: &str,
    client_nonce: &str,
) -> String {
    to_hex(&mac(secret, channel, side, server_nonce, client_nonce).finalize().into_bytes())
}

/// Checks a proof in constant time.
pub fn verify(
    secret: Option<&Secret>,
    channel: &str,
    side: Side,
    server_nonce: &str,
    client_nonce: &str,
    proof_hex: &str,
) -> bool {
    let Some(p) = from_hex(proof_hex) else { return false };
    mac(secret, channel, side, server_nonce, client_nonce).verify_slice(&p).is_ok()
}

/// A fresh transfer capability: 128 random bits, hex-encoded.
pub fn capability() -> Result<String, AuthError> {
    nonce()
}

/// Compares two capabilities (or any two secrets) in time that does not depend on where they
/// first differ.
pub fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut diff = a.len() ^ b.len();
    for i in 0..a.len().max(b.len()) {
        diff |= (*a.get(i).unwrap_or(&0) ^ *b.get(i).unwrap_or(&0)) as usize;
    }
    diff == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_binds_the_secret_the_side_and_both_nonces() {
        let s = Secret::from_text("0123456789abcdef0123", "test").unwrap();
        let other = Secret::from_text("0123456789abcdef0124", "test").unwrap();
        let (sn, cn) = (nonce().unwrap(), nonce().unwrap());
        let p = proof(Some(&s), "producer", Side::Client, &sn, &cn);
        assert!(verify(Some(&s), "producer", Side::Client, &sn, &cn, &p));
        assert!(!verify(Some(&other), "producer", Side::Client, &sn, &cn, &p));
        assert!(!verify(None, "producer", Side::Client, &sn, &cn, &p));
        assert!(!verify(Some(&s), "producer", Side::Server, &sn, &cn, &p));
        assert!(!verify(Some(&s), "side-channel", Side::Client, &sn, &cn, &p));
        assert!(!verify(Some(&s), "producer", Side::Client, &nonce().unwrap(), &cn, &p));
        assert!(!verify(Some(&s), "producer", Side::Client, &sn, &cn, "zz"));
        assert!(!verify(Some(&s), "producer", Side::Client, &sn, &cn, ""));
    }

    #[test]
    fn secrets_are_long_enough_and_never_printed() {
        let e = Secret::from_text("  short\n", "KVCONNECT_SIDE_CHANNEL_TOKEN").unwrap_err().to_string();
        assert!(e.contains("KVCONNECT_SIDE_CHANNEL_TOKEN") && e.contains("5 bytes"), "{e}");
        let g = Secret::generate().unwrap();
        assert_eq!(g.to_text().len(), 64);
        assert_ne!(g, Secret::generate().unwrap());
        assert!(!format!("{g:?}").contains(&g.to_text()));
        assert_eq!(Secret::from_text(&format!("{}\n", g.to_text()), "f").unwrap(), g);
    }

    #[test]
    fn capabilities_are_128_bit_and_distinct() {
        let a = capability().unwrap();
        assert_eq!(a.len(), 32);
        assert_ne!(a, capability().unwrap());
        assert!(same_secret(&a, &a.clone()));
        assert!(!same_secret(&a, &a[..31]));
        assert!(!same_secret(&a, ""));
    }
}
