//! Decoding helpers shared by the card, discovery and event-plane decoders.
//!
//! - [`json`] and [`msgpack`] are where bytes enter serde: each maps the parser's error to an
//!   [`InputError`] naming what was decoded, and [`msgpack`] rejects trailing bytes and caps
//!   nesting depth.
//! - [`MsgpackCursor`] reads MessagePack headers, keys, integers and strings in place and skips
//!   values by their markers: the event plane's readers use it to check counts before they
//!   allocate, and to read envelopes and events without serde; [`Bounded`] keeps at most `MAX`
//!   entries of a list and counts the rest.
//! - [`Embedded`] accepts a nested JSON document either as an object or as a string holding it.
//! - [`WireEndpoint`] is the `{namespace, component, name}` triple.
//! - [`percent_encode`] / [`percent_decode`] implement the escaping of subjects and keys.

use std::fmt;
use std::marker::PhantomData;

use serde::de::{self, DeserializeOwned, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer};

use super::errors::{InputError, echo};
use super::limits::{MSGPACK_DEPTH_MAX, SEGMENT_BYTES_MAX, TEXT_BYTES_MAX};
use crate::model::identity::EndpointPath;

/// Parse `bytes` as JSON into `T`; the caller has already checked the size.
pub(crate) fn json<'a, T: Deserialize<'a>>(
    bytes: &'a [u8],
    what: &'static str,
) -> Result<T, InputError> {
    serde_json::from_slice(bytes)
        .map_err(|error| InputError::Json { what, detail: echo(&error.to_string()) })
}

/// Parse `bytes` as exactly one MessagePack value into `T`, borrowing strings and bytes from
/// `bytes`; the caller has already checked the size.
pub(crate) fn msgpack<'a, T: Deserialize<'a>>(
    bytes: &'a [u8],
    what: &'static str,
) -> Result<T, InputError> {
    if let Some(length) = msgpack_value_len(bytes)
        && length < bytes.len()
    {
        return Err(InputError::TrailingBytes { what, count: bytes.len() - length });
    }
    msgpack_value(bytes, what)
}

/// [`msgpack`] for `bytes` already known to hold exactly one value (no trailing-bytes walk).
pub(crate) fn msgpack_value<'a, T: Deserialize<'a>>(
    bytes: &'a [u8],
    what: &'static str,
) -> Result<T, InputError> {
    let mut deserializer = rmp_serde::Deserializer::from_read_ref(bytes);
    deserializer.set_max_depth(MSGPACK_DEPTH_MAX);
    T::deserialize(&mut deserializer)
        .map_err(|error| InputError::MessagePack { what, detail: echo(&error.to_string()) })
}

/// The big-endian unsigned length field of `width` bytes at `at` in `bytes` (`None` when
/// truncated).
fn read_be(bytes: &[u8], at: usize, width: usize) -> Option<usize> {
    let field = bytes.get(at..at.checked_add(width)?)?;
    Some(field.iter().fold(0usize, |value, byte| value << 8 | usize::from(*byte)))
}

/// The length in bytes of the first MessagePack value in `bytes`, or `None` when it is truncated
/// or uses the reserved marker `0xc1`. Walks markers without recursion or allocation: every step
/// consumes at least one byte, so the walk is bounded by the input length.
pub(crate) fn msgpack_value_len(bytes: &[u8]) -> Option<usize> {
    let mut position = 0usize;
    let mut values_pending: usize = 1;
    while values_pending > 0 {
        values_pending -= 1;
        let marker = *bytes.get(position)?;
        position += 1;
        // (bytes of a length field, fixed body bytes, child values per counted unit)
        let (length_bytes, fixed_bytes, children_per_unit) = match marker {
            0x00..=0x7f | 0xc0 | 0xc2 | 0xc3 | 0xe0..=0xff => (0, 0, 0),
            0x80..=0x8f => {
                values_pending = values_pending.saturating_add(2 * usize::from(marker & 0x0f));
                (0, 0, 0)
            }
            0x90..=0x9f => {
                values_pending = values_pending.saturating_add(usize::from(marker & 0x0f));
                (0, 0, 0)
            }
            0xa0..=0xbf => (0, usize::from(marker & 0x1f), 0),
            0xc1 => return None,
            0xc4 | 0xd9 => (1, 0, 0),
            0xc5 | 0xda => (2, 0, 0),
            0xc6 | 0xdb => (4, 0, 0),
            0xc7 => (1, 1, 0),
            0xc8 => (2, 1, 0),
            0xc9 => (4, 1, 0),
            0xca | 0xce | 0xd2 => (0, 4, 0),
            0xcb | 0xcf | 0xd3 => (0, 8, 0),
            0xcc | 0xd0 => (0, 1, 0),
            0xcd | 0xd1 => (0, 2, 0),
            0xd4 => (0, 2, 0),
            0xd5 => (0, 3, 0),
            0xd6 => (0, 5, 0),
            0xd7 => (0, 9, 0),
            0xd8 => (0, 17, 0),
            0xdc => (2, 0, 1),
            0xdd => (4, 0, 1),
            0xde => (2, 0, 2),
            0xdf => (4, 0, 2),
        };
        let counted = if length_bytes > 0 { read_be(bytes, position, length_bytes)? } else { 0 };
        position += length_bytes;
        if children_per_unit > 0 {
            values_pending =
                values_pending.saturating_add(counted.saturating_mul(children_per_unit));
        } else {
            position = position.checked_add(fixed_bytes)?.checked_add(counted)?;
        }
        if position > bytes.len() {
            return None;
        }
    }
    Some(position)
}

/// A forward reader over MessagePack that decodes only the headers, keys and scalars it is asked
/// for and skips every other value by its markers (no allocation, no recursion, no UTF-8
/// validation).
/// Every method returns `None`, consuming nothing, when the next value is not of the asked kind
/// or is truncated.
#[derive(Debug, Clone)]
pub(crate) struct MsgpackCursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> MsgpackCursor<'a> {
    pub(crate) fn new(bytes: &'a [u8]) -> Self {
        MsgpackCursor { bytes, at: 0 }
    }

    /// A container or string header here: `(declared length, header bytes)` when the marker is
    /// one of `fix` (its low bits hold the length, up to `fix_mask`) or the 1/2/4-byte-length forms
    /// `wide` (`0` where the kind has no such form).
    fn header(&self, fix: u8, fix_mask: u8, wide: [u8; 3]) -> Option<(usize, usize)> {
        let marker = *self.bytes.get(self.at)?;
        if marker & !fix_mask == fix {
            return Some((usize::from(marker & fix_mask), 1));
        }
        let width = match wide.iter().position(|&form| form != 0 && form == marker)? {
            0 => 1,
            1 => 2,
            _ => 4,
        };
        Some((read_be(self.bytes, self.at + 1, width)?, 1 + width))
    }

    /// The declared entry count of the array here, consuming its header.
    pub(crate) fn array_len(&mut self) -> Option<usize> {
        let (length, header) = self.header(0x90, 0x0f, [0, 0xdc, 0xdd])?;
        self.at += header;
        Some(length)
    }

    /// The declared entry count of the map here, consuming its header.
    pub(crate) fn map_len(&mut self) -> Option<usize> {
        let (length, header) = self.header(0x80, 0x0f, [0, 0xde, 0xdf])?;
        self.at += header;
        Some(length)
    }

    /// The bytes of the string here, consuming it.
    pub(crate) fn str(&mut self) -> Option<&'a [u8]> {
        let (length, header) = self.header(0xa0, 0x1f, [0xd9, 0xda, 0xdb])?;
        let start = self.at + header;
        let text = self.bytes.get(start..start.checked_add(length)?)?;
        self.at = start + length;
        Some(text)
    }

    /// The bytes of the binary value here, consuming it.
    pub(crate) fn bin(&mut self) -> Option<&'a [u8]> {
        let width = match *self.bytes.get(self.at)? {
            0xc4 => 1,
            0xc5 => 2,
            0xc6 => 4,
            _ => return None,
        };
        let length = read_be(self.bytes, self.at + 1, width)?;
        let start = self.at + 1 + width;
        let body = self.bytes.get(start..start.checked_add(length)?)?;
        self.at = start + length;
        Some(body)
    }

    /// The integer here, consuming it: `(value, negative)`, a negative value as its 64-bit two's
    /// complement. Any width is accepted.
    pub(crate) fn int(&mut self) -> Option<(u64, bool)> {
        let marker = *self.bytes.get(self.at)?;
        let (width, signed) = match marker {
            0x00..=0x7f => {
                self.at += 1;
                return Some((u64::from(marker), false));
            }
            0xe0..=0xff => {
                self.at += 1;
                return Some((i64::from(marker as i8) as u64, true));
            }
            0xcc..=0xcf => (1usize << (marker - 0xcc), false),
            0xd0..=0xd3 => (1usize << (marker - 0xd0), true),
            _ => return None,
        };
        let field = self.bytes.get(self.at + 1..self.at + 1 + width)?;
        let raw = field.iter().fold(0u64, |value, byte| value << 8 | u64::from(*byte));
        let value = if signed && width < 8 {
            // Sign-extend from the field's width.
            let shift = 64 - 8 * width as u32;
            ((raw << shift) as i64 >> shift) as u64
        } else {
            raw
        };
        self.at += 1 + width;
        Some((value, signed && (value as i64) < 0))
    }

    /// Consume a `nil` here; false (consuming nothing) for any other value.
    pub(crate) fn nil(&mut self) -> bool {
        let nil = self.bytes.get(self.at) == Some(&0xc0);
        self.at += usize::from(nil);
        nil
    }

    /// The bytes read so far.
    pub(crate) fn position(&self) -> usize {
        self.at
    }

    /// Skip the whole value here.
    pub(crate) fn skip(&mut self) -> Option<()> {
        self.at += msgpack_value_len(self.bytes.get(self.at..)?)?;
        Some(())
    }
}

/// Reject an input larger than `max` bytes before parsing it.
pub(crate) fn check_size(bytes: usize, max: usize, what: &'static str) -> Result<(), InputError> {
    if bytes > max {
        return Err(InputError::TooLarge { what, bytes, max });
    }
    Ok(())
}

/// Reject free text (names, paths, addresses) longer than [`TEXT_BYTES_MAX`].
pub(crate) fn check_text(text: &str, field: &'static str) -> Result<(), InputError> {
    check_size(text.len(), TEXT_BYTES_MAX, field)
}

/// Reject a name segment longer than [`SEGMENT_BYTES_MAX`].
pub(crate) fn check_segment(text: &str, field: &'static str) -> Result<(), InputError> {
    check_size(text.len(), SEGMENT_BYTES_MAX, field)
}

/// A list of at most `MAX` entries: entries beyond `MAX` are counted and skipped, never kept, so
/// the conversion can reject the list with its true length after at most `MAX` allocations.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Bounded<T, const MAX: usize> {
    items: Vec<T>,
    count: usize,
}

impl<T, const MAX: usize> Bounded<T, MAX> {
    /// The entries, or [`InputError::TooMany`] if the list had more than `MAX`.
    pub(crate) fn into_checked(self, what: &'static str) -> Result<Vec<T>, InputError> {
        if self.count > MAX {
            return Err(InputError::TooMany { what, count: self.count, max: MAX });
        }
        debug_assert_eq!(self.items.len(), self.count);
        Ok(self.items)
    }
}

impl<'de, T: Deserialize<'de>, const MAX: usize> Deserialize<'de> for Bounded<T, MAX> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct BoundedVisitor<T, const MAX: usize>(PhantomData<T>);
        impl<'de, T: Deserialize<'de>, const MAX: usize> Visitor<'de> for BoundedVisitor<T, MAX> {
            type Value = Bounded<T, MAX>;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(formatter, "a list of at most {MAX} entries")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
                let declared = seq.size_hint().unwrap_or(0);
                let mut items = Vec::new();
                let mut count = 0usize;
                if declared <= MAX {
                    items.reserve(declared);
                    while count < MAX {
                        match seq.next_element::<T>()? {
                            Some(item) => {
                                items.push(item);
                                count += 1;
                            }
                            None => return Ok(Bounded { items, count }),
                        }
                    }
                }
                // Over the limit (declared, or found at MAX): count the rest without keeping it.
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    count = count.saturating_add(1);
                }
                if count > MAX {
                    items = Vec::new();
                }
                Ok(Bounded { items, count })
            }
        }
        deserializer.deserialize_seq(BoundedVisitor::<T, MAX>(PhantomData))
    }
}

/// A nested JSON document given either as an object or as a string that holds the object.
///
/// The object form is decoded in place (so duplicate-key checks of `T` still see every key);
/// the string form is parsed as its own JSON document.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Embedded<T>(pub T);

impl<'de, T: DeserializeOwned> Deserialize<'de> for Embedded<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct EmbeddedVisitor<T>(PhantomData<T>);
        impl<'de, T: DeserializeOwned> Visitor<'de> for EmbeddedVisitor<T> {
            type Value = Embedded<T>;
            fn expecting(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
                formatter.write_str("a JSON object, or a string holding one")
            }
            fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Self::Value, A::Error> {
                T::deserialize(de::value::MapAccessDeserializer::new(map)).map(Embedded)
            }
            fn visit_str<E: de::Error>(self, text: &str) -> Result<Self::Value, E> {
                serde_json::from_str(text).map(Embedded).map_err(E::custom)
            }
        }
        deserializer.deserialize_any(EmbeddedVisitor(PhantomData))
    }
}

/// An endpoint as discovery writes it: `{namespace, component, name}`.
#[derive(Debug, Deserialize)]
pub(crate) struct WireEndpoint {
    namespace: String,
    component: String,
    name: String,
}

impl WireEndpoint {
    /// Validate into an [`EndpointPath`].
    pub(crate) fn into_path(self, field: &'static str) -> Result<EndpointPath, InputError> {
        endpoint_path(self.namespace, self.component, self.name, field)
    }
}

/// Validate three segments into an [`EndpointPath`], bounding each segment's length.
pub(crate) fn endpoint_path(
    namespace: String,
    component: String,
    endpoint: String,
    field: &'static str,
) -> Result<EndpointPath, InputError> {
    for segment in [&namespace, &component, &endpoint] {
        check_segment(segment, field)?;
    }
    EndpointPath::new(namespace, component, endpoint)
        .map_err(|source| InputError::InvalidEndpoint { field, source })
}

/// Bytes kept literal by the event-plane subject rule: `[A-Za-z0-9_-]`.
pub(crate) fn subject_literal(byte: u8) -> bool {
    byte.is_ascii_alphanumeric() || byte == b'_' || byte == b'-'
}

/// Bytes kept literal in file-discovery file names: `[A-Za-z0-9]` (observed: `/`, `_` and `-`
/// are escaped).
pub(crate) fn file_name_literal(byte: u8) -> bool {
    byte.is_ascii_alphanumeric()
}

/// Escape every byte of `text` for which `literal` is false as `%XX` (uppercase hex).
pub(crate) fn percent_encode(text: &str, literal: fn(u8) -> bool) -> String {
    const HEX: &[u8; 16] = b"0123456789ABCDEF";
    let mut out = String::with_capacity(text.len());
    for &byte in text.as_bytes() {
        if literal(byte) {
            out.push(char::from(byte));
        } else {
            out.push('%');
            out.push(char::from(HEX[usize::from(byte >> 4)]));
            out.push(char::from(HEX[usize::from(byte & 0x0f)]));
        }
    }
    out
}

/// Why escaped text could not be unescaped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PercentError {
    /// A `%` not followed by two hex digits.
    BadEscape,
    /// The unescaped bytes are not UTF-8.
    NotUtf8,
}

impl PercentError {
    /// The reason text used in errors.
    pub(crate) fn reason(self) -> &'static str {
        match self {
            PercentError::BadEscape => "'%' not followed by two hex digits",
            PercentError::NotUtf8 => "escaped bytes are not UTF-8",
        }
    }
}

/// Unescape `%XX` (either hex case); every other character is taken literally.
pub(crate) fn percent_decode(text: &str) -> Result<String, PercentError> {
    if !text.contains('%') {
        return Ok(text.to_owned());
    }
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut index = 0;
    while index < bytes.len() {
        let byte = bytes[index];
        if byte == b'%' {
            let high = bytes.get(index + 1).and_then(|digit| hex_value(*digit));
            let low = bytes.get(index + 2).and_then(|digit| hex_value(*digit));
            match (high, low) {
                (Some(high), Some(low)) => out.push(high << 4 | low),
                _ => return Err(PercentError::BadEscape),
            }
            index += 3;
        } else {
            out.push(byte);
            index += 1;
        }
    }
    String::from_utf8(out).map_err(|_| PercentError::NotUtf8)
}

fn hex_value(digit: u8) -> Option<u8> {
    match digit {
        b'0'..=b'9' => Some(digit - b'0'),
        b'a'..=b'f' => Some(digit - b'a' + 10),
        b'A'..=b'F' => Some(digit - b'A' + 10),
        _ => None,
    }
}

/// Parse a lowercase-or-uppercase, unpadded-or-padded hex id of 1 to 16 digits.
pub(crate) fn parse_hex_id(text: &str) -> Option<u64> {
    if text.is_empty() || text.len() > 16 || !text.bytes().all(|byte| byte.is_ascii_hexdigit()) {
        return None;
    }
    u64::from_str_radix(text, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_encoding_keeps_only_the_literal_set_and_round_trips() {
        assert_eq!(percent_encode("kv-events", subject_literal), "kv-events");
        assert_eq!(percent_encode("a.b/c é", subject_literal), "a%2Eb%2Fc%20%C3%A9");
        assert_eq!(percent_encode("kv-events/1f", file_name_literal), "kv%2Devents%2F1f");
        assert_eq!(percent_decode("a%2Eb%2fc%20%C3%A9").as_deref(), Ok("a.b/c é"));
        assert_eq!(percent_decode("%2"), Err(PercentError::BadEscape));
        assert_eq!(percent_decode("%zz"), Err(PercentError::BadEscape));
        assert_eq!(percent_decode("%FF"), Err(PercentError::NotUtf8));
    }

    #[test]
    fn hex_ids_are_one_to_sixteen_hex_digits_without_sign() {
        assert_eq!(parse_hex_id("dc71242afcad0e39"), Some(15884517127758876217));
        assert_eq!(parse_hex_id("0"), Some(0));
        assert_eq!(parse_hex_id("ffffffffffffffff"), Some(u64::MAX));
        assert_eq!(parse_hex_id("1ffffffffffffffff"), None);
        assert_eq!(parse_hex_id("+1"), None);
        assert_eq!(parse_hex_id(""), None);
        assert_eq!(parse_hex_id("xyz"), None);
    }

    #[test]
    fn bounded_lists_report_their_true_length_without_keeping_the_excess() {
        let three: Bounded<u8, 2> = serde_json::from_str("[1,2,3]").unwrap();
        assert_eq!(
            three.into_checked("test list"),
            Err(InputError::TooMany { what: "test list", count: 3, max: 2 })
        );
        let two: Bounded<u8, 2> = serde_json::from_str("[1,2]").unwrap();
        assert_eq!(two.into_checked("test list"), Ok(vec![1, 2]));
        // MessagePack declares the length up front: the excess is skipped, not decoded.
        let bytes = rmp_serde::to_vec(&[1u8, 2, 3, 4]).unwrap();
        let four: Bounded<u8, 2> = msgpack(&bytes, "test list").unwrap();
        assert!(four.items.is_empty());
        assert_eq!(four.count, 4);
    }

    #[test]
    fn the_cursor_reads_integers_of_every_width_and_sign() {
        let values: [i128; 14] = [
            0,
            127,
            128,
            255,
            256,
            65_535,
            65_536,
            1 << 32,
            u64::MAX as i128,
            -1,
            -32,
            -33,
            -129,
            i64::MIN as i128,
        ];
        for value in values {
            let bytes = if value < 0 {
                rmp_serde::to_vec(&(value as i64)).unwrap()
            } else {
                rmp_serde::to_vec(&(value as u64)).unwrap()
            };
            let mut cursor = MsgpackCursor::new(&bytes);
            assert_eq!(cursor.int(), Some((value as u64, value < 0)), "{value}");
            assert_eq!(cursor.position(), bytes.len(), "{value}");
        }
        // Signed markers holding non-negative values, as some writers use.
        for bytes in [&[0xd0, 0x05][..], &[0xd1, 0x00, 0x05], &[0xd3, 0, 0, 0, 0, 0, 0, 0, 5]] {
            assert_eq!(MsgpackCursor::new(bytes).int(), Some((5, false)));
        }
        // Not an integer, or truncated: nothing consumed.
        for bytes in [&[0xc0][..], &[0xcb, 0, 0, 0, 0, 0, 0, 0, 0], &[0xcf, 1, 2], &[]] {
            let mut cursor = MsgpackCursor::new(bytes);
            assert_eq!(cursor.int(), None);
            assert_eq!(cursor.position(), 0);
        }
        let mut cursor = MsgpackCursor::new(&[0xc0, 0x01]);
        assert!(cursor.nil() && !cursor.nil());
        assert_eq!(cursor.int(), Some((1, false)));
    }
}
