//! The call-home response stream as a sans-IO state machine (dynamo-planes-wire §A.5).
//!
//! After the handshake (consumed by the listener, which routes the connection by its subject) a
//! worker sends, as two-part messages: the prologue `{"error":null}` (header only), one item
//! `{"data": <answer>, "complete_final": false}` (body only), the end marker
//! `{"complete_final": true}` (body only) and the sentinel `"sentinel"` (header only). The I/O
//! shell reads and decodes frames and hands them to [`ResponseStream::handle`]; the machine
//! enforces their order and keeps the answer.
//!
//! Strictness: a recovery answer is one item; a second item is a protocol violation rather than
//! something to ignore, because a future worker that split a tree dump across items would
//! otherwise be read as a truncated dump. The connection ending after `complete_final` but
//! before the sentinel still yields the answer (the logical stream is complete).

use super::RecoveryError;
use super::message::{ControlFrame, ItemFrame};
use kvrelay_core::sources::RecoveryResponse;

/// What a two-part message of the response stream is, by which part it fills.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FrameKind {
    /// Header only: a JSON control frame (prologue, sentinel).
    Control,
    /// Body only (or empty): an item wrapper in the payload codec.
    Item,
}

/// Classify a frame by its part lengths; a frame with both parts is not part of the protocol.
pub fn classify_frame(header_len: u64, body_len: u64) -> Result<FrameKind, RecoveryError> {
    match (header_len, body_len) {
        (0, _) => Ok(FrameKind::Item),
        (_, 0) => Ok(FrameKind::Control),
        _ => Err(RecoveryError::Protocol("response frame with both header and body".to_owned())),
    }
}

/// One decoded frame of the response stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StreamFrame {
    /// A header-only control frame.
    Control(ControlFrame),
    /// A body-only item frame.
    Item(ItemFrame),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    AwaitingPrologue,
    Items,
    Final,
    Done,
}

/// The order of one response stream and the answer it carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ResponseStream {
    state: State,
    answer: Option<RecoveryResponse>,
}

impl Default for ResponseStream {
    fn default() -> Self {
        Self::new()
    }
}

impl ResponseStream {
    /// A stream whose handshake has been read.
    #[must_use]
    pub fn new() -> Self {
        ResponseStream { state: State::AwaitingPrologue, answer: None }
    }

    /// Take the next frame. Returns `Ok(true)` once the sentinel has been read: the caller then
    /// closes the connection and calls [`finish`](Self::finish).
    pub fn handle(&mut self, frame: StreamFrame) -> Result<bool, RecoveryError> {
        let violation = |what: &str| Err(RecoveryError::Protocol(what.to_owned()));
        match (self.state, frame) {
            (State::AwaitingPrologue, StreamFrame::Control(ControlFrame::PrologueOk)) => {
                self.state = State::Items;
            }
            (State::AwaitingPrologue, StreamFrame::Control(ControlFrame::PrologueFailed(text))) => {
                return Err(RecoveryError::StreamFailed { message: text });
            }
            (State::AwaitingPrologue, _) => return violation("response stream without a prologue"),
            (State::Items, StreamFrame::Item(item)) => {
                if let Some(answer) = item.answer {
                    if self.answer.is_some() {
                        return violation("more than one response item");
                    }
                    self.answer = Some(answer);
                }
                if item.complete_final {
                    self.state = State::Final;
                }
            }
            (State::Items, StreamFrame::Control(ControlFrame::Sentinel)) => {
                return Err(RecoveryError::StreamEnded {
                    after: "the prologue, before complete_final",
                });
            }
            (State::Items, StreamFrame::Control(_)) => {
                return violation("a second prologue in the response stream");
            }
            (State::Final, StreamFrame::Control(ControlFrame::Sentinel)) => {
                self.state = State::Done;
                return Ok(true);
            }
            (State::Final, _) => {
                return violation("a frame between complete_final and the sentinel");
            }
            (State::Done, _) => return violation("a frame after the sentinel"),
        }
        Ok(false)
    }

    /// The answer, once the logical stream is complete (sentinel read, or the connection ended
    /// after `complete_final`).
    pub fn finish(self) -> Result<RecoveryResponse, RecoveryError> {
        match self.state {
            State::Final | State::Done => self.answer.ok_or(RecoveryError::NoAnswer),
            State::AwaitingPrologue => {
                Err(RecoveryError::StreamEnded { after: "the handshake, before the prologue" })
            }
            State::Items => {
                Err(RecoveryError::StreamEnded { after: "the prologue, before complete_final" })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(answer: Option<RecoveryResponse>, complete_final: bool) -> StreamFrame {
        StreamFrame::Item(ItemFrame { answer, complete_final })
    }

    fn answer() -> RecoveryResponse {
        RecoveryResponse::Error("x".into())
    }

    #[test]
    fn the_captured_order_yields_the_answer() {
        let mut stream = ResponseStream::new();
        assert_eq!(stream.handle(StreamFrame::Control(ControlFrame::PrologueOk)), Ok(false));
        assert_eq!(stream.handle(item(Some(answer()), false)), Ok(false));
        assert_eq!(stream.handle(item(None, true)), Ok(false));
        assert_eq!(stream.handle(StreamFrame::Control(ControlFrame::Sentinel)), Ok(true));
        assert_eq!(stream.finish(), Ok(answer()));
    }

    #[test]
    fn a_connection_closed_after_complete_final_still_answers() {
        let mut stream = ResponseStream::new();
        stream.handle(StreamFrame::Control(ControlFrame::PrologueOk)).unwrap();
        stream.handle(item(Some(answer()), true)).unwrap();
        assert_eq!(stream.finish(), Ok(answer()));
    }

    #[test]
    fn early_ends_and_disorder_are_errors() {
        let mut failed = ResponseStream::new();
        assert_eq!(
            failed.handle(StreamFrame::Control(ControlFrame::PrologueFailed("boom".into()))),
            Err(RecoveryError::StreamFailed { message: "boom".into() })
        );

        let mut cut_short = ResponseStream::new();
        cut_short.handle(StreamFrame::Control(ControlFrame::PrologueOk)).unwrap();
        cut_short.handle(item(Some(answer()), false)).unwrap();
        assert!(matches!(cut_short.clone().finish(), Err(RecoveryError::StreamEnded { .. })));
        assert!(matches!(
            cut_short.handle(StreamFrame::Control(ControlFrame::Sentinel)),
            Err(RecoveryError::StreamEnded { .. })
        ));

        let mut twice = ResponseStream::new();
        twice.handle(StreamFrame::Control(ControlFrame::PrologueOk)).unwrap();
        twice.handle(item(Some(answer()), false)).unwrap();
        assert!(matches!(
            twice.handle(item(Some(answer()), false)),
            Err(RecoveryError::Protocol(_))
        ));

        let mut no_prologue = ResponseStream::new();
        assert!(matches!(no_prologue.handle(item(None, true)), Err(RecoveryError::Protocol(_))));

        let mut empty = ResponseStream::new();
        empty.handle(StreamFrame::Control(ControlFrame::PrologueOk)).unwrap();
        empty.handle(item(None, true)).unwrap();
        assert_eq!(empty.finish(), Err(RecoveryError::NoAnswer));
    }

    #[test]
    fn frames_are_classified_by_their_parts() {
        assert_eq!(classify_frame(10, 0), Ok(FrameKind::Control));
        assert_eq!(classify_frame(0, 17), Ok(FrameKind::Item));
        assert_eq!(classify_frame(0, 0), Ok(FrameKind::Item));
        assert!(classify_frame(1, 1).is_err());
    }
}
