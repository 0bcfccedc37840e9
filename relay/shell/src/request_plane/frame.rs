//! Byte framing of the TCP request plane (dynamo-planes-wire §A.3, §A.5), without I/O.
//!
//! - The **request frame** (caller → worker, pooled connection): `u16 BE path_len, path,
//!   u16 BE headers_len, headers (JSON), u32 BE payload_len, payload`.
//! - The **ACK frame** (worker → caller, same connection): `u32 BE length` then that many bytes;
//!   length 0 accepts, anything else is the rejection text.
//! - The **two-part message** (the request payload, and every frame of the call-home response
//!   stream): `u64 BE header_len, u64 BE body_len, u64 BE checksum, header, body`. Writers put
//!   checksum 0 (as release builds of Dynamo do); a reader verifies a non-zero checksum as XXH3-64
//!   (seed 0) over `header || body`.

use xxhash_rust::xxh3::Xxh3;

use super::RecoveryError;

/// Length of a two-part message's fixed header: three u64 big-endian fields.
pub const TWO_PART_PREFIX_BYTES: usize = 24;

/// Largest request payload the worker accepts (`DYN_TCP_MAX_MESSAGE_SIZE`, 32 MiB by default).
pub const REQUEST_PAYLOAD_BYTES_MAX: usize = 32 << 20;

/// The fixed 24-byte prefix of a two-part message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TwoPartPrefix {
    /// Bytes of the header part.
    pub header_len: u64,
    /// Bytes of the body part.
    pub body_len: u64,
    /// XXH3-64 of `header || body`, or 0 when not computed.
    pub checksum: u64,
}

impl TwoPartPrefix {
    /// Parse the prefix.
    #[must_use]
    pub fn parse(bytes: &[u8; TWO_PART_PREFIX_BYTES]) -> Self {
        let field = |at: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&bytes[at..at + 8]);
            u64::from_be_bytes(word)
        };
        TwoPartPrefix { header_len: field(0), body_len: field(8), checksum: field(16) }
    }

    /// Whether `header` and `body` agree with the checksum (always true for checksum 0).
    #[must_use]
    pub fn checksum_matches(&self, header: &[u8], body: &[u8]) -> bool {
        if self.checksum == 0 {
            return true;
        }
        let mut hasher = Xxh3::new();
        hasher.update(header);
        hasher.update(body);
        hasher.digest() == self.checksum
    }
}

/// Encode a two-part message with checksum 0.
#[must_use]
pub fn encode_two_part(header: &[u8], body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(TWO_PART_PREFIX_BYTES + header.len() + body.len());
    out.extend_from_slice(&(header.len() as u64).to_be_bytes());
    out.extend_from_slice(&(body.len() as u64).to_be_bytes());
    out.extend_from_slice(&0u64.to_be_bytes());
    out.extend_from_slice(header);
    out.extend_from_slice(body);
    out
}

/// Encode a request frame. Fails when a part does not fit its length field, or the payload
/// exceeds [`REQUEST_PAYLOAD_BYTES_MAX`].
pub fn encode_request_frame(
    path: &str,
    headers: &[u8],
    payload: &[u8],
) -> Result<Vec<u8>, RecoveryError> {
    let too_large = |what, bytes, max| RecoveryError::RequestTooLarge { what, bytes, max };
    let path_len = u16::try_from(path.len())
        .map_err(|_| too_large("endpoint path", path.len(), usize::from(u16::MAX)))?;
    let headers_len = u16::try_from(headers.len())
        .map_err(|_| too_large("request headers", headers.len(), usize::from(u16::MAX)))?;
    if payload.len() > REQUEST_PAYLOAD_BYTES_MAX {
        return Err(too_large("request payload", payload.len(), REQUEST_PAYLOAD_BYTES_MAX));
    }
    let payload_len = u32::try_from(payload.len())
        .map_err(|_| too_large("request payload", payload.len(), REQUEST_PAYLOAD_BYTES_MAX))?;
    let mut out = Vec::with_capacity(8 + path.len() + headers.len() + payload.len());
    out.extend_from_slice(&path_len.to_be_bytes());
    out.extend_from_slice(path.as_bytes());
    out.extend_from_slice(&headers_len.to_be_bytes());
    out.extend_from_slice(headers);
    out.extend_from_slice(&payload_len.to_be_bytes());
    out.extend_from_slice(payload);
    Ok(out)
}

/// The worker's answer on the request connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ack {
    /// Length 0: the request was accepted (which does not mean it will be answered: a request
    /// the worker cannot decode is accepted too, and then never called home).
    Accepted,
    /// The worker refused the request, e.g. `Server unavailable: unknown endpoint <path>`.
    Rejected(String),
}

impl Ack {
    /// The ACK whose text (after the length field) is `text`.
    #[must_use]
    pub fn from_text(text: &[u8]) -> Self {
        if text.is_empty() {
            Ack::Accepted
        } else {
            Ack::Rejected(String::from_utf8_lossy(text).into_owned())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_part_prefix_round_trips_and_checks_non_zero_checksums() {
        let message = encode_two_part(b"{\"error\":null}", b"");
        assert_eq!(message.len(), TWO_PART_PREFIX_BYTES + 14);
        let mut prefix_bytes = [0u8; TWO_PART_PREFIX_BYTES];
        prefix_bytes.copy_from_slice(&message[..TWO_PART_PREFIX_BYTES]);
        let prefix = TwoPartPrefix::parse(&prefix_bytes);
        assert_eq!(prefix, TwoPartPrefix { header_len: 14, body_len: 0, checksum: 0 });
        assert!(prefix.checksum_matches(b"anything", b"at all"));

        let header = b"h";
        let body = b"body";
        let sum = xxhash_rust::xxh3::xxh3_64(b"hbody");
        let checked = TwoPartPrefix { header_len: 1, body_len: 4, checksum: sum };
        assert!(checked.checksum_matches(header, body));
        assert!(!checked.checksum_matches(header, b"bodY"));
    }

    #[test]
    fn request_frame_lays_out_big_endian_lengths() {
        let frame = encode_request_frame("a/b", b"{}", b"xyz").unwrap();
        assert_eq!(frame, b"\x00\x03a/b\x00\x02{}\x00\x00\x00\x03xyz");
        let long_path = "p".repeat(usize::from(u16::MAX) + 1);
        assert!(matches!(
            encode_request_frame(&long_path, b"", b""),
            Err(RecoveryError::RequestTooLarge { what: "endpoint path", .. })
        ));
    }

    #[test]
    fn empty_ack_accepts_and_text_rejects() {
        assert_eq!(Ack::from_text(b""), Ack::Accepted);
        assert_eq!(
            Ack::from_text(b"Server overloaded: worker at capacity"),
            Ack::Rejected("Server overloaded: worker at capacity".into())
        );
    }
}
