//! ZMTP 3.x framing for the SUB side of the event plane (ZeroMQ RFC 23 and 37, NULL mechanism;
//! dynamo-planes-wire §B.3–B.4), without I/O.
//!
//! [`ZmtpSubDecoder`] turns the bytes a PUB peer sends into [`ZmtpEvent`]s: it checks the
//! 64-byte greeting, waits for the peer's `READY` command, then yields whole multipart messages
//! (and `PING`s to answer). The encoders write what a SUB sends: its greeting, its `READY`, its
//! subscription, and `PONG`s.
//!
//! Invariants:
//!
//! - **Every length is checked before anything is kept.** A frame header's declared size is
//!   compared with [`ZmtpLimits`] as soon as the header is complete, before one byte of its body
//!   is waited for; the decoder never reserves memory from a declared size, and only splits a
//!   frame off the input once all its bytes are there.
//! - **A message is bounded as it grows.** Each frame of a multipart message is counted against
//!   [`ZmtpLimits::message_frames_max`] and its size against [`ZmtpLimits::message_bytes_max`]
//!   from its header, so an endless multipart message fails after a bounded number of bytes.
//! - **Any violation ends the session.** Errors are [`ZmtpError`]s; after one, the decoder's
//!   state is unspecified and the connection must be dropped.
//! - Commands are bounded by [`ZMTP_COMMAND_BYTES_MAX`]; unknown commands after the handshake are
//!   skipped (RFC 37), an `ERROR` command ends the session.

use bytes::{Buf, Bytes, BytesMut};
use thiserror::Error;

use kvrelay_core::inputs::ZMQ_EVENT_FRAME_HEADER_BYTES;
use kvrelay_core::inputs::limits::EVENT_ENVELOPE_BYTES_MAX;

/// Size of a ZMTP 3 greeting.
pub const ZMTP_GREETING_BYTES: usize = 64;

/// Largest command body accepted (a `READY` carries a socket type and at most a 255-byte
/// identity; libzmq's own commands are far smaller).
pub const ZMTP_COMMAND_BYTES_MAX: u64 = 4096;

/// Default largest message frame: an event frame (`u8 version`, `u32 BE length`) around the
/// largest event envelope the relay decodes.
pub const ZMTP_FRAME_BYTES_MAX: u64 =
    (ZMQ_EVENT_FRAME_HEADER_BYTES + EVENT_ENVELOPE_BYTES_MAX) as u64;

/// Default most frames in one message (Dynamo sends 4: topic, publisher id, sequence, event).
pub const ZMTP_MESSAGE_FRAMES_MAX: usize = 8;

/// Default largest message: one largest frame plus room for the small routing frames.
pub const ZMTP_MESSAGE_BYTES_MAX: u64 = ZMTP_FRAME_BYTES_MAX + 4096;

/// Frame flag: more frames of this message follow.
const FLAG_MORE: u8 = 0x01;
/// Frame flag: the size is a u64 BE instead of a u8.
const FLAG_LONG: u8 = 0x02;
/// Frame flag: the frame is a command.
const FLAG_COMMAND: u8 = 0x04;

/// The NULL mechanism as it appears in a greeting (name padded with zeros to 20 bytes).
const MECHANISM_NULL: [u8; 20] = *b"NULL\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0";

/// Bounds applied to what a peer declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZmtpLimits {
    /// Largest message frame (bytes of its body).
    pub frame_bytes_max: u64,
    /// Most frames in one multipart message (at least 1).
    pub message_frames_max: usize,
    /// Largest sum of frame bodies in one message.
    pub message_bytes_max: u64,
}

impl Default for ZmtpLimits {
    fn default() -> Self {
        ZmtpLimits {
            frame_bytes_max: ZMTP_FRAME_BYTES_MAX,
            message_frames_max: ZMTP_MESSAGE_FRAMES_MAX,
            message_bytes_max: ZMTP_MESSAGE_BYTES_MAX,
        }
    }
}

/// Why a ZMTP session cannot go on.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ZmtpError {
    /// The first 10 bytes are not a ZMTP 3 signature (`ff`, 8 bytes, `7f`).
    #[error("not a ZMTP signature")]
    BadSignature,
    /// The peer's major version is below 3.
    #[error("unsupported ZMTP version {major}.{minor}")]
    UnsupportedVersion {
        /// The peer's major version.
        major: u8,
        /// The peer's minor version.
        minor: u8,
    },
    /// The peer's security mechanism is not NULL.
    #[error("unsupported security mechanism (only NULL is spoken)")]
    UnsupportedMechanism,
    /// A frame's flags set reserved bits, or a command claims more frames.
    #[error("invalid frame flags {flags:#04x}")]
    InvalidFlags {
        /// The flags byte.
        flags: u8,
    },
    /// A message frame declares more bytes than the limit.
    #[error("a frame declares {declared} bytes, over the limit of {limit}")]
    FrameTooLarge {
        /// The declared size.
        declared: u64,
        /// The limit.
        limit: u64,
    },
    /// A command declares more bytes than [`ZMTP_COMMAND_BYTES_MAX`].
    #[error("a command declares {declared} bytes, over the limit of {ZMTP_COMMAND_BYTES_MAX}")]
    CommandTooLarge {
        /// The declared size.
        declared: u64,
    },
    /// A multipart message has more frames than the limit.
    #[error("a message has more than {limit} frames")]
    TooManyFrames {
        /// The limit.
        limit: usize,
    },
    /// A multipart message's frames add up to more than the limit.
    #[error("a message grows past {limit} bytes")]
    MessageTooLarge {
        /// The limit.
        limit: u64,
    },
    /// A command body does not parse.
    #[error("malformed command: {reason}")]
    MalformedCommand {
        /// What is wrong.
        reason: &'static str,
    },
    /// The peer sent something other than `READY` during the handshake.
    #[error("unexpected frame during the handshake")]
    UnexpectedFrame,
    /// The peer's `READY` names no socket type, or one a SUB cannot talk to.
    #[error("peer socket type is not PUB or XPUB")]
    IncompatibleSocketType,
    /// The peer sent an `ERROR` command.
    #[error("peer reported an error")]
    PeerError,
}

/// [`ZmtpError`] without its details, to count errors by kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ZmtpErrorKind {
    /// [`ZmtpError::BadSignature`].
    BadSignature,
    /// [`ZmtpError::UnsupportedVersion`].
    UnsupportedVersion,
    /// [`ZmtpError::UnsupportedMechanism`].
    UnsupportedMechanism,
    /// [`ZmtpError::InvalidFlags`].
    InvalidFlags,
    /// [`ZmtpError::FrameTooLarge`].
    FrameTooLarge,
    /// [`ZmtpError::CommandTooLarge`].
    CommandTooLarge,
    /// [`ZmtpError::TooManyFrames`].
    TooManyFrames,
    /// [`ZmtpError::MessageTooLarge`].
    MessageTooLarge,
    /// [`ZmtpError::MalformedCommand`].
    MalformedCommand,
    /// [`ZmtpError::UnexpectedFrame`].
    UnexpectedFrame,
    /// [`ZmtpError::IncompatibleSocketType`].
    IncompatibleSocketType,
    /// [`ZmtpError::PeerError`].
    PeerError,
}

impl ZmtpErrorKind {
    /// Every kind, in declaration order ([`index`](Self::index) is the position here).
    pub const ALL: [ZmtpErrorKind; 12] = [
        ZmtpErrorKind::BadSignature,
        ZmtpErrorKind::UnsupportedVersion,
        ZmtpErrorKind::UnsupportedMechanism,
        ZmtpErrorKind::InvalidFlags,
        ZmtpErrorKind::FrameTooLarge,
        ZmtpErrorKind::CommandTooLarge,
        ZmtpErrorKind::TooManyFrames,
        ZmtpErrorKind::MessageTooLarge,
        ZmtpErrorKind::MalformedCommand,
        ZmtpErrorKind::UnexpectedFrame,
        ZmtpErrorKind::IncompatibleSocketType,
        ZmtpErrorKind::PeerError,
    ];

    /// Position in [`ALL`](Self::ALL).
    #[must_use]
    pub fn index(self) -> usize {
        self as usize
    }

    /// A stable snake_case name (for metrics labels).
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            ZmtpErrorKind::BadSignature => "bad_signature",
            ZmtpErrorKind::UnsupportedVersion => "unsupported_version",
            ZmtpErrorKind::UnsupportedMechanism => "unsupported_mechanism",
            ZmtpErrorKind::InvalidFlags => "invalid_flags",
            ZmtpErrorKind::FrameTooLarge => "frame_too_large",
            ZmtpErrorKind::CommandTooLarge => "command_too_large",
            ZmtpErrorKind::TooManyFrames => "too_many_frames",
            ZmtpErrorKind::MessageTooLarge => "message_too_large",
            ZmtpErrorKind::MalformedCommand => "malformed_command",
            ZmtpErrorKind::UnexpectedFrame => "unexpected_frame",
            ZmtpErrorKind::IncompatibleSocketType => "incompatible_socket_type",
            ZmtpErrorKind::PeerError => "peer_error",
        }
    }
}

impl ZmtpError {
    /// The kind of this error.
    #[must_use]
    pub fn kind(&self) -> ZmtpErrorKind {
        match self {
            ZmtpError::BadSignature => ZmtpErrorKind::BadSignature,
            ZmtpError::UnsupportedVersion { .. } => ZmtpErrorKind::UnsupportedVersion,
            ZmtpError::UnsupportedMechanism => ZmtpErrorKind::UnsupportedMechanism,
            ZmtpError::InvalidFlags { .. } => ZmtpErrorKind::InvalidFlags,
            ZmtpError::FrameTooLarge { .. } => ZmtpErrorKind::FrameTooLarge,
            ZmtpError::CommandTooLarge { .. } => ZmtpErrorKind::CommandTooLarge,
            ZmtpError::TooManyFrames { .. } => ZmtpErrorKind::TooManyFrames,
            ZmtpError::MessageTooLarge { .. } => ZmtpErrorKind::MessageTooLarge,
            ZmtpError::MalformedCommand { .. } => ZmtpErrorKind::MalformedCommand,
            ZmtpError::UnexpectedFrame => ZmtpErrorKind::UnexpectedFrame,
            ZmtpError::IncompatibleSocketType => ZmtpErrorKind::IncompatibleSocketType,
            ZmtpError::PeerError => ZmtpErrorKind::PeerError,
        }
    }
}

/// What the decoder found in the peer's bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ZmtpEvent {
    /// The peer's greeting and `READY` were accepted: the subscription may be sent now.
    Ready {
        /// Whether the peer speaks ZMTP 3.1 or later, so takes the `SUBSCRIBE` command form
        /// (a 3.0 peer takes the `0x01`+topic message form).
        subscribe_command: bool,
    },
    /// One whole multipart message, its frames in order (at least one).
    Message(Vec<Bytes>),
    /// A `PING` to answer with [`encode_pong`] of this context.
    Ping {
        /// The ping's context (at most 16 bytes).
        context: Bytes,
    },
}

/// Where the session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Greeting,
    Handshake { subscribe_command: bool },
    Traffic,
}

/// A validated frame header.
#[derive(Debug, Clone, Copy)]
struct FrameHeader {
    header_bytes: usize,
    body_bytes: usize,
    more: bool,
    command: bool,
}

/// Decoder of the byte stream a PUB peer sends to a SUB (see the module invariants).
#[derive(Debug, Clone)]
pub struct ZmtpSubDecoder {
    limits: ZmtpLimits,
    phase: Phase,
    frames: Vec<Bytes>,
    message_bytes: u64,
}

impl ZmtpSubDecoder {
    /// A decoder at the start of a session, applying `limits`.
    #[must_use]
    pub fn new(limits: ZmtpLimits) -> Self {
        ZmtpSubDecoder { limits, phase: Phase::Greeting, frames: Vec::new(), message_bytes: 0 }
    }

    /// Whether the handshake is over (a [`ZmtpEvent::Ready`] was returned).
    #[must_use]
    pub fn is_ready(&self) -> bool {
        self.phase == Phase::Traffic
    }

    /// Decode the next event from the front of `input`, consuming the bytes it used.
    /// `Ok(None)`: `input` holds no complete event yet (what it holds is kept for the next call
    /// and has been checked as far as it goes).
    pub fn decode(&mut self, input: &mut BytesMut) -> Result<Option<ZmtpEvent>, ZmtpError> {
        loop {
            if self.phase == Phase::Greeting {
                let Some(subscribe_command) = parse_greeting(input)? else {
                    return Ok(None);
                };
                input.advance(ZMTP_GREETING_BYTES);
                self.phase = Phase::Handshake { subscribe_command };
            }
            let Some(header) = self.frame_header(input)? else {
                return Ok(None);
            };
            let total = header.header_bytes + header.body_bytes;
            if input.len() < total {
                return Ok(None);
            }
            input.advance(header.header_bytes);
            let body = input.split_to(header.body_bytes).freeze();
            if header.command {
                if let Some(event) = self.command(&body)? {
                    return Ok(Some(event));
                }
                continue;
            }
            self.message_bytes += body.len() as u64;
            self.frames.push(body);
            if !header.more {
                self.message_bytes = 0;
                return Ok(Some(ZmtpEvent::Message(std::mem::take(&mut self.frames))));
            }
        }
    }

    /// Parse and check the frame header at the front of `input` (`None`: incomplete).
    fn frame_header(&self, input: &[u8]) -> Result<Option<FrameHeader>, ZmtpError> {
        let Some(&flags) = input.first() else {
            return Ok(None);
        };
        let command = flags & FLAG_COMMAND != 0;
        let more = flags & FLAG_MORE != 0;
        if flags & !(FLAG_MORE | FLAG_LONG | FLAG_COMMAND) != 0 || (command && more) {
            return Err(ZmtpError::InvalidFlags { flags });
        }
        let (header_bytes, declared) = if flags & FLAG_LONG != 0 {
            let Some(size) = input.get(1..9) else {
                return Ok(None);
            };
            let mut be = [0u8; 8];
            be.copy_from_slice(size);
            (9, u64::from_be_bytes(be))
        } else {
            let Some(&size) = input.get(1) else {
                return Ok(None);
            };
            (2, u64::from(size))
        };
        if command {
            if declared > ZMTP_COMMAND_BYTES_MAX {
                return Err(ZmtpError::CommandTooLarge { declared });
            }
        } else if self.phase == Phase::Traffic {
            self.check_message_frame(declared)?;
        } else {
            return Err(ZmtpError::UnexpectedFrame);
        }
        let body_bytes = usize::try_from(declared).map_err(|_| ZmtpError::FrameTooLarge {
            declared,
            limit: self.limits.frame_bytes_max,
        })?;
        Ok(Some(FrameHeader { header_bytes, body_bytes, more, command }))
    }

    /// Check a message frame of `declared` bytes against the limits, given the frames so far.
    fn check_message_frame(&self, declared: u64) -> Result<(), ZmtpError> {
        let limits = &self.limits;
        if declared > limits.frame_bytes_max {
            return Err(ZmtpError::FrameTooLarge { declared, limit: limits.frame_bytes_max });
        }
        if self.frames.len() >= limits.message_frames_max {
            return Err(ZmtpError::TooManyFrames { limit: limits.message_frames_max });
        }
        if self.message_bytes.saturating_add(declared) > limits.message_bytes_max {
            return Err(ZmtpError::MessageTooLarge { limit: limits.message_bytes_max });
        }
        Ok(())
    }

    /// Act on one command; `Some` when it is an event for the caller.
    fn command(&mut self, body: &Bytes) -> Result<Option<ZmtpEvent>, ZmtpError> {
        let (name, data) = split_command(body)?;
        if let Phase::Handshake { subscribe_command } = self.phase {
            if name.eq_ignore_ascii_case(b"ERROR") {
                return Err(ZmtpError::PeerError);
            }
            if !name.eq_ignore_ascii_case(b"READY") {
                return Err(ZmtpError::UnexpectedFrame);
            }
            check_ready(data)?;
            self.phase = Phase::Traffic;
            return Ok(Some(ZmtpEvent::Ready { subscribe_command }));
        }
        if name.eq_ignore_ascii_case(b"ERROR") {
            return Err(ZmtpError::PeerError);
        }
        if name.eq_ignore_ascii_case(b"PING") {
            // TTL (u16 BE), then up to 16 bytes of context.
            let context = body.slice(1 + name.len()..);
            if context.len() < 2 {
                return Err(ZmtpError::MalformedCommand { reason: "PING without a TTL" });
            }
            let context = context.slice(2..);
            if context.len() > 16 {
                return Err(ZmtpError::MalformedCommand { reason: "PING context over 16 bytes" });
            }
            return Ok(Some(ZmtpEvent::Ping { context }));
        }
        // PONG, SUBSCRIBE, CANCEL and unknown commands carry nothing for a SUB.
        Ok(None)
    }
}

/// Check the greeting at the front of `input` (`None`: fewer than 64 bytes, which are checked as
/// far as they go). Returns whether the peer takes the 3.1 `SUBSCRIBE` command.
fn parse_greeting(input: &[u8]) -> Result<Option<bool>, ZmtpError> {
    if input.first().is_some_and(|&byte| byte != 0xff) || input.get(9).is_some_and(|&b| b != 0x7f) {
        return Err(ZmtpError::BadSignature);
    }
    if let (Some(&major), Some(&minor)) = (input.get(10), input.get(11))
        && major < 3
    {
        return Err(ZmtpError::UnsupportedVersion { major, minor });
    }
    if input.len() < ZMTP_GREETING_BYTES {
        return Ok(None);
    }
    if input[12..32] != MECHANISM_NULL {
        return Err(ZmtpError::UnsupportedMechanism);
    }
    let (major, minor) = (input[10], input[11]);
    Ok(Some(major > 3 || minor >= 1))
}

/// Split a command body into its name and data.
fn split_command(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let Some((&name_len, rest)) = body.split_first() else {
        return Err(ZmtpError::MalformedCommand { reason: "empty command" });
    };
    let name_len = usize::from(name_len);
    if name_len == 0 || rest.len() < name_len {
        return Err(ZmtpError::MalformedCommand { reason: "command name overruns the frame" });
    }
    Ok(rest.split_at(name_len))
}

/// Check a `READY` command's metadata: well-formed properties, a `Socket-Type` of PUB or XPUB.
fn check_ready(mut metadata: &[u8]) -> Result<(), ZmtpError> {
    let overrun = ZmtpError::MalformedCommand { reason: "READY property overruns the command" };
    let mut socket_type_ok = false;
    while let Some((&name_len, rest)) = metadata.split_first() {
        let name_len = usize::from(name_len);
        if name_len == 0 || rest.len() < name_len + 4 {
            return Err(overrun);
        }
        let (name, rest) = rest.split_at(name_len);
        let (value_len, rest) = rest.split_at(4);
        let value_len =
            u32::from_be_bytes([value_len[0], value_len[1], value_len[2], value_len[3]]);
        let value_len = usize::try_from(value_len).map_err(|_| overrun.clone())?;
        if rest.len() < value_len {
            return Err(overrun);
        }
        let (value, rest) = rest.split_at(value_len);
        if name.eq_ignore_ascii_case(b"Socket-Type") {
            socket_type_ok = value == b"PUB" || value == b"XPUB";
            if !socket_type_ok {
                return Err(ZmtpError::IncompatibleSocketType);
            }
        }
        metadata = rest;
    }
    if socket_type_ok { Ok(()) } else { Err(ZmtpError::IncompatibleSocketType) }
}

/// The greeting a SUB sends: signature, version 3.1, NULL mechanism, as-server 0, filler.
#[must_use]
pub fn encode_greeting() -> [u8; ZMTP_GREETING_BYTES] {
    let mut greeting = [0u8; ZMTP_GREETING_BYTES];
    greeting[0] = 0xff;
    // Padding as libzmq writes it (a 0.x peer would read a 1-byte identity length).
    greeting[8] = 0x01;
    greeting[9] = 0x7f;
    greeting[10] = 3;
    greeting[11] = 1;
    greeting[12..32].copy_from_slice(&MECHANISM_NULL);
    greeting
}

/// One frame with `flags` (LONG is added when the body needs it).
fn encode_frame(flags: u8, body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(9 + body.len());
    match u8::try_from(body.len()) {
        Ok(short) => frame.extend([flags, short]),
        Err(_) => {
            frame.push(flags | FLAG_LONG);
            frame.extend((body.len() as u64).to_be_bytes());
        }
    }
    frame.extend_from_slice(body);
    frame
}

/// A command frame: `name` (at most 255 bytes, truncated otherwise) and its data.
#[must_use]
pub fn encode_command(name: &[u8], data: &[u8]) -> Vec<u8> {
    let name = &name[..name.len().min(255)];
    let mut body = Vec::with_capacity(1 + name.len() + data.len());
    body.push(name.len() as u8);
    body.extend_from_slice(name);
    body.extend_from_slice(data);
    encode_frame(FLAG_COMMAND, &body)
}

/// A `READY` command naming `socket_type` (e.g. `SUB`) as its only property.
#[must_use]
pub fn encode_ready(socket_type: &[u8]) -> Vec<u8> {
    let property = b"Socket-Type";
    let mut data = Vec::with_capacity(1 + property.len() + 4 + socket_type.len());
    data.push(property.len() as u8);
    data.extend_from_slice(property);
    data.extend((socket_type.len() as u32).to_be_bytes());
    data.extend_from_slice(socket_type);
    encode_command(b"READY", &data)
}

/// The subscription to the prefix `topic`: the 3.1 `SUBSCRIBE` command, or for a 3.0 peer the
/// message `0x01`+topic.
#[must_use]
pub fn encode_subscribe(topic: &[u8], subscribe_command: bool) -> Vec<u8> {
    if subscribe_command {
        return encode_command(b"SUBSCRIBE", topic);
    }
    let mut body = Vec::with_capacity(1 + topic.len());
    body.push(0x01);
    body.extend_from_slice(topic);
    encode_frame(0, &body)
}

/// The answer to a `PING` with `context`.
#[must_use]
pub fn encode_pong(context: &[u8]) -> Vec<u8> {
    encode_command(b"PONG", context)
}

/// One message frame; `more` when further frames of the message follow.
#[must_use]
pub fn encode_message_frame(body: &[u8], more: bool) -> Vec<u8> {
    encode_frame(if more { FLAG_MORE } else { 0 }, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A PUB's greeting with `version`.
    fn greeting(version: (u8, u8)) -> Vec<u8> {
        let mut greeting = encode_greeting().to_vec();
        greeting[10] = version.0;
        greeting[11] = version.1;
        greeting
    }

    fn handshake() -> Vec<u8> {
        let mut bytes = greeting((3, 1));
        bytes.extend(encode_ready(b"PUB"));
        bytes
    }

    fn small_limits() -> ZmtpLimits {
        ZmtpLimits { frame_bytes_max: 1000, message_frames_max: 4, message_bytes_max: 1500 }
    }

    /// Decode everything in `bytes` fed one byte at a time, stopping at the first error.
    fn decode_bytewise(limits: ZmtpLimits, bytes: &[u8]) -> (Vec<ZmtpEvent>, Option<ZmtpError>) {
        let mut decoder = ZmtpSubDecoder::new(limits);
        let mut input = BytesMut::new();
        let mut events = Vec::new();
        for &byte in bytes {
            input.extend_from_slice(&[byte]);
            loop {
                match decoder.decode(&mut input) {
                    Ok(Some(event)) => events.push(event),
                    Ok(None) => break,
                    Err(error) => return (events, Some(error)),
                }
            }
        }
        (events, None)
    }

    fn decode_error(limits: ZmtpLimits, bytes: &[u8]) -> ZmtpError {
        let (_, error) = decode_bytewise(limits, bytes);
        error.expect("the input was accepted")
    }

    #[test]
    fn a_handshake_and_messages_decode_in_any_chunking() {
        let mut bytes = handshake();
        bytes.extend(encode_command(b"PING", &[0, 10, b'h', b'i']));
        bytes.extend(encode_message_frame(b"kv-events", true));
        bytes.extend(encode_message_frame(&7u64.to_be_bytes(), true));
        bytes.extend(encode_message_frame(&[9u8; 300], false));
        bytes.extend(encode_command(b"PONG", b""));
        bytes.extend(encode_command(b"UNKNOWN", b"x"));
        bytes.extend(encode_message_frame(b"", false));
        let expected = vec![
            ZmtpEvent::Ready { subscribe_command: true },
            ZmtpEvent::Ping { context: Bytes::from_static(b"hi") },
            ZmtpEvent::Message(vec![
                Bytes::from_static(b"kv-events"),
                Bytes::copy_from_slice(&7u64.to_be_bytes()),
                Bytes::from(vec![9u8; 300]),
            ]),
            ZmtpEvent::Message(vec![Bytes::new()]),
        ];
        let (events, error) = decode_bytewise(ZmtpLimits::default(), &bytes);
        assert_eq!((events, error), (expected.clone(), None));
        // All at once.
        let mut decoder = ZmtpSubDecoder::new(ZmtpLimits::default());
        let mut input = BytesMut::from(&bytes[..]);
        let mut events = Vec::new();
        while let Some(event) = decoder.decode(&mut input).unwrap() {
            events.push(event);
        }
        assert_eq!(events, expected);
        assert!(input.is_empty() && decoder.is_ready());
    }

    #[test]
    fn a_3_0_peer_takes_the_legacy_subscription() {
        let mut bytes = greeting((3, 0));
        bytes.extend(encode_ready(b"XPUB"));
        let (events, error) = decode_bytewise(ZmtpLimits::default(), &bytes);
        assert_eq!(events, vec![ZmtpEvent::Ready { subscribe_command: false }]);
        assert_eq!(error, None);
        assert_eq!(encode_subscribe(b"kv", false), [0x00, 0x03, 0x01, b'k', b'v']);
        assert_eq!(
            encode_subscribe(b"kv-events", true),
            [&[0x04, 0x13, 0x09][..], b"SUBSCRIBE", b"kv-events"].concat()
        );
    }

    #[test]
    fn the_encoders_write_the_captured_handshake() {
        // dynamo-planes-wire §B.3.
        let greeting = encode_greeting();
        assert_eq!(greeting[..12], [0xff, 0, 0, 0, 0, 0, 0, 0, 0x01, 0x7f, 3, 1]);
        assert_eq!(&greeting[12..16], b"NULL");
        assert!(greeting[16..].iter().all(|&byte| byte == 0));
        let ready =
            [&[0x04, 0x19, 0x05][..], b"READY", &[0x0b], b"Socket-Type", &[0, 0, 0, 3], b"SUB"]
                .concat();
        assert_eq!(encode_ready(b"SUB"), ready);
        let long = encode_message_frame(&[0u8; 256], false);
        assert_eq!(long[..9], [0x02, 0, 0, 0, 0, 0, 0, 1, 0]);
    }

    #[test]
    fn bad_greetings_are_refused_as_early_as_they_show() {
        let limits = ZmtpLimits::default();
        assert_eq!(decode_error(limits, &[0x00]), ZmtpError::BadSignature);
        let mut bad = greeting((3, 1));
        bad[9] = 0x7e;
        assert_eq!(decode_error(limits, &bad[..10]), ZmtpError::BadSignature);
        assert_eq!(
            decode_error(limits, &greeting((2, 9))[..12]),
            ZmtpError::UnsupportedVersion { major: 2, minor: 9 }
        );
        let mut curve = greeting((3, 1));
        curve[12..17].copy_from_slice(b"CURVE");
        assert_eq!(decode_error(limits, &curve), ZmtpError::UnsupportedMechanism);
        // Later versions are accepted (and take the command form).
        let mut later = greeting((4, 0));
        later.extend(encode_ready(b"PUB"));
        let (events, _) = decode_bytewise(limits, &later);
        assert_eq!(events, vec![ZmtpEvent::Ready { subscribe_command: true }]);
    }

    #[test]
    fn the_handshake_needs_a_ready_from_a_publisher() {
        let limits = ZmtpLimits::default();
        let with = |frame: Vec<u8>| [greeting((3, 1)), frame].concat();
        assert_eq!(
            decode_error(limits, &with(encode_ready(b"SUB"))),
            ZmtpError::IncompatibleSocketType
        );
        assert_eq!(
            decode_error(limits, &with(encode_command(b"READY", b""))),
            ZmtpError::IncompatibleSocketType
        );
        assert_eq!(
            decode_error(limits, &with(encode_message_frame(b"x", false))),
            ZmtpError::UnexpectedFrame
        );
        assert_eq!(
            decode_error(limits, &with(encode_command(b"PING", b"\0\0"))),
            ZmtpError::UnexpectedFrame
        );
        assert_eq!(
            decode_error(limits, &with(encode_command(b"ERROR", b"\x03bad"))),
            ZmtpError::PeerError
        );
        // A property whose value length runs past the command.
        let overrun = encode_command(
            b"READY",
            &[&[0x0b][..], b"Socket-Type", &[0, 0, 0, 9], b"PUB"].concat(),
        );
        assert!(matches!(decode_error(limits, &with(overrun)), ZmtpError::MalformedCommand { .. }));
        let unnamed = encode_command(b"", b"");
        assert!(matches!(decode_error(limits, &with(unnamed)), ZmtpError::MalformedCommand { .. }));
        assert!(matches!(
            decode_error(limits, &with(vec![0x04, 0x00])),
            ZmtpError::MalformedCommand { .. }
        ));
    }

    #[test]
    fn declared_sizes_are_refused_from_the_header_alone() {
        let limits = small_limits();
        // A 2^40-byte frame: refused once its 9-byte header is in, with no body sent.
        let mut huge = handshake();
        huge.push(0x02);
        huge.extend((1u64 << 40).to_be_bytes());
        assert_eq!(
            decode_error(limits, &huge),
            ZmtpError::FrameTooLarge { declared: 1 << 40, limit: 1000 }
        );
        let mut max = handshake();
        max.push(0x03);
        max.extend(u64::MAX.to_be_bytes());
        assert!(matches!(decode_error(limits, &max), ZmtpError::FrameTooLarge { .. }));
        // A command over the command bound.
        let mut command = handshake();
        command.push(0x06);
        command.extend((ZMTP_COMMAND_BYTES_MAX + 1).to_be_bytes());
        assert_eq!(
            decode_error(limits, &command),
            ZmtpError::CommandTooLarge { declared: ZMTP_COMMAND_BYTES_MAX + 1 }
        );
        // Also during the handshake.
        let mut early = greeting((3, 1));
        early.push(0x06);
        early.extend(u64::MAX.to_be_bytes());
        assert!(matches!(decode_error(limits, &early), ZmtpError::CommandTooLarge { .. }));
    }

    #[test]
    fn multipart_messages_are_bounded_in_frames_and_bytes() {
        let limits = small_limits();
        let mut endless = handshake();
        for _ in 0..5 {
            endless.extend(encode_message_frame(b"more", true));
        }
        let (events, error) = decode_bytewise(limits, &endless);
        assert_eq!(events.len(), 1, "only the handshake completed");
        assert_eq!(error, Some(ZmtpError::TooManyFrames { limit: 4 }));
        let mut heavy = handshake();
        heavy.extend(encode_message_frame(&[0u8; 900], true));
        heavy.extend(encode_message_frame(&[0u8; 900], false)[..9].to_vec());
        assert_eq!(decode_error(limits, &heavy), ZmtpError::MessageTooLarge { limit: 1500 });
        // Exactly at the bounds is fine, and the next message starts from zero.
        let mut full = handshake();
        for _ in 0..2 {
            full.extend(encode_message_frame(&[0u8; 1000], true));
            full.extend(encode_message_frame(&[0u8; 500], false));
        }
        let (events, error) = decode_bytewise(limits, &full);
        assert_eq!((events.len(), error), (3, None));
    }

    #[test]
    fn reserved_flags_and_bad_commands_end_the_session() {
        let limits = ZmtpLimits::default();
        for flags in [0x08, 0x80, 0x05] {
            let mut bytes = handshake();
            bytes.extend([flags, 0]);
            assert_eq!(decode_error(limits, &bytes), ZmtpError::InvalidFlags { flags });
        }
        let with = |frame: Vec<u8>| [handshake(), frame].concat();
        assert!(matches!(
            decode_error(limits, &with(encode_command(b"PING", b"\0"))),
            ZmtpError::MalformedCommand { .. }
        ));
        assert!(matches!(
            decode_error(limits, &with(encode_command(b"PING", &[0u8; 19]))),
            ZmtpError::MalformedCommand { .. }
        ));
        assert_eq!(
            decode_error(limits, &with(encode_command(b"ERROR", b""))),
            ZmtpError::PeerError
        );
        assert_eq!(
            ZmtpErrorKind::ALL.iter().map(|kind| kind.index()).collect::<Vec<_>>(),
            (0..12).collect::<Vec<_>>()
        );
    }
}
