//! Where the `watch`, `query` and `demo` commands print.
//!
//! On a terminal, `watch` and `demo` redraw one frame in place (cursor home, clear, the frame);
//! anywhere else every line is appended, so a pipe or a log file gets plain, greppable text
//! without escape codes. A reader that goes away (`kvrelay watch | head`) ends the command
//! quietly instead of panicking on the broken pipe.

use std::io::{self, IsTerminal, Write};

/// Cursor to the top-left corner, then clear to the end of the screen.
const HOME_AND_CLEAR: &str = "\x1b[H\x1b[J";

/// One command's standard output.
#[derive(Debug)]
pub struct Screen {
    redraw: bool,
}

impl Screen {
    /// Frames redraw in place when `in_place` is asked for and standard output is a terminal.
    #[must_use]
    pub fn new(in_place: bool) -> Self {
        Screen { redraw: in_place && io::stdout().is_terminal() }
    }

    /// Whether [`Screen::frame`] replaces the previous frame.
    #[must_use]
    pub fn redraws(&self) -> bool {
        self.redraw
    }

    /// Append `lines`; `false` once the reader has gone.
    pub fn lines(&mut self, lines: &[String]) -> io::Result<bool> {
        write_lines(&mut io::stdout().lock(), None, lines)
    }

    /// Show `lines` as the new frame (in place on a terminal, appended otherwise); `false`
    /// once the reader has gone.
    pub fn frame(&mut self, lines: &[String]) -> io::Result<bool> {
        let prefix = self.redraw.then_some(HOME_AND_CLEAR);
        write_lines(&mut io::stdout().lock(), prefix, lines)
    }
}

/// Write `prefix` and `lines` and flush; a broken pipe is `Ok(false)`, any other error an error.
fn write_lines(out: &mut impl Write, prefix: Option<&str>, lines: &[String]) -> io::Result<bool> {
    let written = (|| {
        if let Some(prefix) = prefix {
            out.write_all(prefix.as_bytes())?;
        }
        for line in lines {
            out.write_all(line.as_bytes())?;
            out.write_all(b"\n")?;
        }
        out.flush()
    })();
    match written {
        Ok(()) => Ok(true),
        Err(error) if error.kind() == io::ErrorKind::BrokenPipe => Ok(false),
        Err(error) => Err(error),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer whose reader left after `room` bytes.
    struct Pipe {
        written: Vec<u8>,
        room: usize,
    }

    impl Write for Pipe {
        fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
            if self.written.len() >= self.room {
                return Err(io::ErrorKind::BrokenPipe.into());
            }
            let take = bytes.len().min(self.room - self.written.len());
            self.written.extend_from_slice(&bytes[..take]);
            Ok(take)
        }

        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn frames_clear_first_and_a_gone_reader_is_not_an_error() {
        let lines = vec!["a".to_owned(), "b".to_owned()];
        let mut pipe = Pipe { written: Vec::new(), room: 64 };
        assert!(write_lines(&mut pipe, Some(HOME_AND_CLEAR), &lines).unwrap());
        assert_eq!(pipe.written, b"\x1b[H\x1b[Ja\nb\n");
        let mut closed = Pipe { written: Vec::new(), room: 1 };
        assert!(!write_lines(&mut closed, None, &lines).unwrap());
    }
}
