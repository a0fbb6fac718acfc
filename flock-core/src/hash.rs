//! Content hashes: the identity of a byte string, used as a resource's version and as
//! the per-file ledger entry of the CNI installer.

use sha2::{Digest, Sha256};
use std::fmt;

/// SHA-256 of some bytes.
///
/// Two values with the same `ContentHash` are treated as the same content: an xDS
/// resource whose hash did not change is never resent, and a CNI config file whose hash
/// equals what we last wrote to *that file* is our own write.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ContentHash([u8; 32]);

impl ContentHash {
    /// Hashes `bytes`.
    pub fn of(bytes: &[u8]) -> Self {
        Self(Sha256::digest(bytes).into())
    }

    /// The raw digest.
    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }

    /// Lowercase hex, 64 characters: the form used in xDS `version` fields and logs.
    pub fn to_hex(&self) -> String {
        const HEX: &[u8; 16] = b"0123456789abcdef";
        let mut out = String::with_capacity(64);
        for b in self.0 {
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 0x0f)] as char);
        }
        out
    }

    /// The first 16 hex characters: enough to tell versions apart in a log line.
    pub fn short(&self) -> String {
        let mut hex = self.to_hex();
        hex.truncate(16);
        hex
    }
}

impl fmt::Debug for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ContentHash({})", self.short())
    }
}

impl fmt::Display for ContentHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn hex_is_the_sha256_of_the_bytes() {
        // Known answer: sha256("abc").
        assert_eq!(
            ContentHash::of(b"abc").to_hex(),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(ContentHash::of(b"abc").short(), "ba7816bf8f01cfea");
    }

    #[test]
    fn different_bytes_differ() {
        assert_ne!(ContentHash::of(b"a"), ContentHash::of(b"b"));
    }
}
